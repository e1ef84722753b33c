-- The sequence of a serial column of an effect table: an INSERT that takes its default
-- calls nextval(), which needs USAGE.
GRANT USAGE ON SEQUENCE {sequence} TO {role};
