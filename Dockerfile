# The image the Kubernetes manifests in deploy/ run: agent and collector, one image.
# Build: docker build -t xpusense:0.1.0 .
# Debian bookworm: python3 3.11 (the project's floor) and bcc from Debian (python3-bpfcc; the PyPI
# "bcc" is another project). Kernel headers are not in the image: the DaemonSet mounts the host's
# /lib/modules and /usr/src, which bcc compiles the probes against.
FROM debian:bookworm-slim

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-bpfcc libbpfcc iproute2 procps ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/xpusense/src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY agent/ agent/
COPY collector/ collector/
COPY probes/ probes/
COPY client/ client/
COPY common/ common/

# The package into its own virtualenv, then Debian's bcc module linked in (as scripts/setup.sh does).
# The collector's C reader of batches (collector/_wire_rows.c) is compiled here, its compiler and
# headers removed in the same layer (without them the package installs and reads batches through
# protobuf, ~100 us a batch more).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
 && python3 -m venv /opt/xpusense/venv \
 && /opt/xpusense/venv/bin/pip install . \
 && /opt/xpusense/venv/bin/python -c 'import xpusense.collector._wire_rows' \
 && apt-get purge -y --auto-remove gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s /usr/lib/python3/dist-packages/bcc \
        "$(/opt/xpusense/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/bcc" \
 && /opt/xpusense/venv/bin/xpusense-agent --help >/dev/null \
 && /opt/xpusense/venv/bin/xpusense-collector --help >/dev/null

ENV PATH=/opt/xpusense/venv/bin:$PATH
WORKDIR /
# The agent runs as root with limited capabilities (deploy/agent-daemonset.yaml); the collector's
# Deployment sets a non-root user.
EXPOSE 7470 9470
CMD ["xpusense-agent", "run"]
