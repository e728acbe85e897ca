"""A gRPC health check through the collector's own TLS, for Kubernetes exec probes (the kubelet's
built-in gRPC probe cannot present a client certificate; docs/security.md "Kubernetes"). Exits 0
when the service answers SERVING, 1 when it does not or cannot be reached, 2 on unusable flags.

    python -m xpusense.collector.probe --address 127.0.0.1:7470 --service xpusense.v1.Ingest \
        --tls-ca CA --tls-cert CERT --tls-key KEY --server-name xpusense-gateway.xpusense.svc"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from xpusense.common.config import ConfigError
from xpusense.common.tls import make_channel

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
NAMES = {"address": "--address", "tls_ca": "--tls-ca", "tls_cert": "--tls-cert", "tls_key": "--tls-key",
         "token_file": "--token-file", "insecure": "--insecure"}


def check(address: str, service: str = "", timeout_s: float = 3.0, tls_ca: str = "", tls_cert: str = "",
          tls_key: str = "", server_name: str = "") -> str | None:
    """None when `service` ("" : the whole server) answers SERVING, else why not (one line).
    ConfigError names the flag when the TLS files are unusable."""
    keys = SimpleNamespace(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token_file="", insecure=False)
    # The probe dials the pod's own loopback; the certificate names the Service.
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    factory = make_channel(address, keys, options=options, names=NAMES)
    with factory() as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=timeout_s)
        except grpc.RpcError as e:
            return f"{address}: {e.code().name}: {e.details()}"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return f"{address}: {service or 'the server'} is {status}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xpusense.collector.probe",
                                description="gRPC health check over the collector's TLS (Kubernetes exec probes)")
    env = os.environ.get
    p.add_argument("--address", default="127.0.0.1:7470", help="HOST:PORT of the collector, gateway or scheduler")
    p.add_argument("--service", default="", help="the health service name ('' : the whole server)")
    p.add_argument("--tls-ca", default=env("XPUSENSE_TLS_CA", ""), help="CA of the server's certificate")
    p.add_argument("--tls-cert", default=env("XPUSENSE_TLS_CERT", ""), help="client certificate (mTLS)")
    p.add_argument("--tls-key", default=env("XPUSENSE_TLS_KEY", ""), help="its private key")
    p.add_argument("--server-name", default="", help="the name the server's certificate must carry (its Service)")
    p.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the check")
    args = p.parse_args(argv)
    if args.timeout_s <= 0:
        p.error("--timeout-s must be above 0")
    try:
        why = check(args.address, args.service, args.timeout_s, args.tls_ca, args.tls_cert, args.tls_key,
                    args.server_name)
    except ConfigError as e:
        print(f"xpusense probe: {e}", file=sys.stderr)
        return EXIT_USAGE
    if why is not None:
        print(f"xpusense probe: {why}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
