"""Planning: ``plan``, the methods and their registry, migration-aware and locality-aware planning,
series objectives and the robust search, certificates."""
