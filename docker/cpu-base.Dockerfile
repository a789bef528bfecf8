# LOCAL TEST BASE ONLY: a stand-in for the public SGLang GPU base on a machine without a
# registry or a GPU. docker/test.sh builds it on top of a Debian bookworm rootfs made with
# mmdebstrap + `podman import`, then builds the production docker/Dockerfile on it with
# --build-arg BASE_IMAGE=localhost/mg-cpu-base:<tag> --build-arg MG_INSTALL=cpu.
#
# It carries this machine's extra CA certificates and pip settings so that pip inside a build
# reaches the package registry. Never publish it, never base a production image on it.
#
# Build context: a scratch folder that test.sh fills with ca/ (the machine's
# /usr/local/share/ca-certificates). /opt/wheels (the local torch CPU wheel), /opt/pypi and
# /opt/pypi-more are bind-mounted read-only into the build (podman build -v), the same paths
# the host's pip configuration names.
ARG ROOTFS_IMAGE=localhost/mg-bookworm-rootfs:latest
FROM ${ROOTFS_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates > /dev/null

# The same index settings as the host's pip (pip config list): the registry plus local
# file indexes and the folder with the torch CPU wheel (present only when mounted).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    PIP_EXTRA_INDEX_URL="file:///opt/pypi/simple file:///opt/pypi-more/simple" \
    PIP_FIND_LINKS=/opt/wheels \
    PIP_DEFAULT_TIMEOUT=180 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# python3 / pip resolve to this venv (bookworm's system python is "externally managed").
# torch 2.13.0 CPU comes from the mounted /opt/wheels: a plain `pip install torch` here would
# pull several GB of CUDA wheels.
ARG TORCH_VERSION=2.13.0
RUN python3 -m venv "${VIRTUAL_ENV}" \
 && pip install --no-cache-dir --quiet "torch==${TORCH_VERSION}" \
 && python3 -c "import torch; assert not torch.cuda.is_available(); print('torch', torch.__version__)"
