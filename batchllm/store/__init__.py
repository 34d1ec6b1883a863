"""Stage 2, the store: jobs and shards in SQL, the state machine that alone writes their states,
shard leases and the recovery queries the reconciler runs. Reads no part files, writes none."""
