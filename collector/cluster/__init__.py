"""Cluster mode: the fleet tier on a NATS JetStream cluster (docs/scale.md).

    subjects   ids -> subject tokens and KV keys, partitions, streams, message ids
    config     the [nats] table
    engine     the connection, and the streams and buckets cluster mode keeps
    nats_auth  one NATS identity per role, its permissions, the servers' authorization and TLS
    marks      per-(node, boot) marks in the `marks` bucket; SeqWindow, exactly once downstream
    gateway    the agent protocol, batches published with ack-after-publish-ack
    summary    the per-node summary in the `fleet` bucket (worker side and reader side)
    worker     partitions by lease, durable consumers, summaries
    query      ListNodes from the fleet bucket; history  GetHistory from the stream
    scheduler  the scheduler core over the watched fleet bucket (replicas; Prometheus there too)
    export     OTLP export from the streams, a durable consumer
    rpc, serve the gateway's gRPC server; cli  the commands (serve --nats, worker, scheduler, exporter)
    localnats  a real nats-server cluster on loopback (tests, bench, demo)
"""
