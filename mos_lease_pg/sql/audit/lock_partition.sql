-- No row may join the partition between its export and its drop.
LOCK TABLE {schema}.{partition} IN SHARE MODE
