# CPU image: the server's default (the shipped sonic-lite model on ONNX Runtime).
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY server ./server
COPY inference ./inference
COPY engines ./engines
COPY configs ./configs
COPY static ./static
# The install step (pip install .). PIP_OPTIONS (empty by default) adds options to pip, e.g. a
# wheelhouse for a build that cannot reach an index: --build-arg PIP_OPTIONS="--no-index
# --find-links /wheels" with the wheels mounted there for the build (podman build -v
# WHEELS:/wheels:ro, as scripts/container_image.py does; docs/containers.md).
ARG PIP_OPTIONS=""
RUN pip install --no-cache-dir $PIP_OPTIONS .

# HTTP, and media on a fixed UDP range (ice.udp_ports), so both can be published:
#   docker run -p 8080:8080 -p 40000-40099:40000-40099/udp IMAGE
# Peers outside the container's network need the container's address reachable
# (--network host) or a TURN server (compose.yaml runs coturn beside it).
EXPOSE 8080/tcp 40000-40099/udp
ENTRYPOINT ["python", "-m", "server", "--host", "0.0.0.0", "--port", "8080", \
            "--set", "ice.udp_ports=40000,40099"]
