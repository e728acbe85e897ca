"""Cluster mode: the fleet tier on a NATS JetStream cluster (docs/scale.md). Stateless gateways
(gateway, rpc, serve) publish agents' batches into JetStream; workers (worker, summary) own
partitions by lease and keep each node's summary in the `fleet` bucket; scheduler replicas
(scheduler, query) and the OTLP exporter (export) read the bucket and the streams. Beside them:
subjects, config, engine (the connection, streams and buckets), nats_auth (one identity per role),
seq_marks (per-boot marks, exactly once downstream), series_defs (the compact encoding's series
definitions in the `series` bucket), stream_history (GetHistory), cli, and localnats (a real
nats-server cluster on loopback for tests, the bench and the demo)."""
