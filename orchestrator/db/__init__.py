"""All SQL lives in this package: table definitions, statements by entity, connections,
configuration of the database location and migrations. Nothing outside it imports SQLAlchemy
or psycopg (enforced by ruff's banned-api rule)."""
