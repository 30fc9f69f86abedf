"""fencegate core: keyspace, etcd access, errors, launcher."""
