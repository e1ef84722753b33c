DROP TABLE {schema}.{partition}
