# Tollbooth sidecar image. Build: docker build -t tollbooth .
FROM python:3.11-slim
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
