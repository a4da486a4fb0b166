# Tollbooth sidecar image. Build: docker build -t tollbooth .
# The simulator's image (docker-compose.yml's simulator services): docker build --target lab .
FROM python:3.11-slim AS tollbooth
WORKDIR /app
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN pip install --no-cache-dir . && useradd --system --uid 10001 tollbooth \
    && mkdir -p /var/lib/tollbooth && chown tollbooth /var/lib/tollbooth
USER tollbooth
# Only the API is meant to be published. The admin listener (/metrics carries user ids and API-key
# hashes) stays on the container's loopback unless a private network needs it: docker-compose.yml
# binds it for Prometheus on the compose network and publishes it nowhere.
EXPOSE 8080
ENTRYPOINT ["tollbooth"]
CMD ["serve", "--listen", "0.0.0.0:8080", "--admin-listen", "127.0.0.1:9464"]

# The lab beside the sidecar, for `tollbooth simulate`: the simulator needs nothing the sidecar does
# not (matplotlib is for the bench's charts only), hence --no-deps.
FROM tollbooth AS lab
USER root
COPY lab ./lab
RUN pip install --no-cache-dir --no-deps ./lab
USER tollbooth

# The default target: the production image, without the lab.
FROM tollbooth
