"""Scheduler core: ranks the fleet's nodes for a job, from the collector's live fleet state.

A request asks for `count` devices of one type (GPU, NPU or any), each with `memory_bytes` of HBM
free, on one node (in one NVLink/HCCS domain when `same_domain`). The answer is every node that can
take it, ranked by the platform's cost-benefit matrix:

    total = (w_compute * compute + w_data * data_affinity + w_dr * disaster_tolerance
             + w_compliance * compliance) * product(penalty factors)

    compute            = value_norm * free
      value            = peak TFLOPS (catalog) / price per accelerator-hour (node label `price`)
      value_norm       = value / best value in the fleet (0.5 when TFLOPS or price is unknown)
      free             = mean over the chosen devices of mean(1 - utilisation, free HBM / HBM,
                         1 - HBM bandwidth utilisation), over the readings the device has
    data_affinity      = 1 - 0.5 * min(1, latency_ms / latency_ref_ms)
                           - 0.5 * min(1, transfer_cost / transfer_cost_ref)
                         node region -> data region; 1 in the data's region, 0 for a pair with
                         neither figure; 1 when no data region is given. latency_ms: the pair's
                         measured round-trip time when the fleet has a recent one, else the
                         configured matrix's (read as round-trip too); transfer cost: configured.
      measured         = median over the region's nodes that report
                         xpusense.network.tcp.rtt{remote_region = data region} (eBPF tcp_rtt) of
                         each node's median RTT over the last measured_latency_window_s
                         (interpolated within its log2 bucket, whose upper bound alone overstates
                         by up to 2x); a node's figure counts for measured_latency_max_age_s after
                         its last new sample. One figure per region pair, not per node: it is part
                         of the placement key's score, which the search works out once per bucket
                         (latency.py). The answer says which latency it used.
    disaster_tolerance = 1 - (the job's other replicas in this node's zone) / (all other replicas);
                         1 when none are given, 0.5 when the node has no `zone` label
    compliance         = 0.5 * encryption + 0.5 * attestation (node labels `encryption`,
                         `attestation`: a capability name or true counts 1, none/false/absent 0)

Hard filters (the node is left out, the answer says why): telemetry older than `stale_s`;
`allowed_regions`; data residency (region or province); required encryption/attestation; not
enough devices of the type with enough free HBM. Health, per accelerator: an XID or double-bit
ECC event within `xid_window_s`, or a health state other than OK (the newer of the
`xpusense.accelerator.health` series and the last `health` event), takes the device out; a
checkpoint request from the HBM watch within `hbm_watch_window_s`, or a diagnosis open on the
device (docs/diagnosis.md, for as long as it is open), keeps the device but multiplies the node's
score by `hbm_watch_factor` when the device is among those chosen (penalty reason `hbm_watch`,
`diagnosis`, or `hbm_watch+diagnosis`).

Chosen devices: among the node's offered devices with `memory_bytes` free, the `count` best by
free score, those not penalised first (the penalty applies only when a penalised one must be taken).

The modules, each importing only those above it:
    scoring    the four dimensions as pure functions
    config     the [scheduler] schema, weights and their ranges, Settings, PlaceError
    inventory  memory sizes, price label, interconnect domains, peak TFLOPS (xpusense.common.catalog)
    latency    measured RTT: a node's window over its tcp_rtt histograms, the median per region pair
    index      per-node summaries (Device, Group, NodeSummary) filed in Pools of Buckets of Entries
    fleet      FleetView: follows FleetState through its watcher and keeps the index up to date
    search     Query; the indexed search and the reference scan
    explain    the answer's per-dimension breakdown and the reasons nodes were left out
    core       Scheduler: place(request) -> PlaceReply
    service    the gRPC service and the `xpusense-collector place` command
"""
