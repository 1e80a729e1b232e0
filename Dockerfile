# jaxnitro's serving image: `jaxnitro serve` with KServe's conventions as defaults.
#
#   docker build -t jaxnitro-serve .                                   # CPU
#   docker build -t jaxnitro-serve:cuda --build-arg ACCELERATOR=cuda12 .  # NVIDIA GPUs
#   docker run -p 8080:8080 -p 9000:9000 -v $PWD/models:/mnt/models jaxnitro-serve
#
# The model repository is /mnt/models (<model>/<version>/ bundles: where KServe's storage
# initializer puts a storageUri), REST on 8080 and gRPC on 9000 (KServe's ports for the
# Open Inference Protocol, REST and gRPC V2), /metrics on 8080. Flags given after the image
# (docker run ... IMAGE --http-port 8081, or a container's `args` in Kubernetes) come after
# these and override them: the last value of a flag wins. It runs as UID 1000, not root.
# Compiled programs persist in /var/cache/jaxnitro (mount a volume there, e.g. an emptyDir
# or a PVC, so a restarted pod skips its warm-up compiles).

ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON}-slim
# cpu, or cuda12 (JAX's CUDA 12 wheels, which bring their CUDA libraries; the host needs the
# NVIDIA driver and the container toolkit).
ARG ACCELERATOR=cpu
RUN useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin jaxnitro \
    && mkdir -p /mnt/models /var/cache/jaxnitro \
    && chown 1000:1000 /mnt/models /var/cache/jaxnitro \
    && chmod 700 /var/cache/jaxnitro
COPY --from=wheel /wheels /wheels
RUN set -eu; wheel=$(ls /wheels/jaxnitro-*.whl); \
    if [ "$ACCELERATOR" = cuda12 ]; then extra="jax[cuda12]"; else extra=""; fi; \
    pip install --no-cache-dir "${wheel}[serve]" $extra && rm -rf /wheels
ENV JAXNITRO_COMPILATION_CACHE=/var/cache/jaxnitro/xla \
    PYTHONUNBUFFERED=1
USER 1000
WORKDIR /home/jaxnitro
EXPOSE 8080 9000
ENTRYPOINT ["jaxnitro", "serve", "--host", "0.0.0.0", "--model-repository", "/mnt/models", "--http-port", "8080", "--grpc-port", "9000", "--no-metrics-port"]
CMD []
