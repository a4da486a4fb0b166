# Tollbooth sidecar image. Build: docker build -t tollbooth .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN pip install --no-cache-dir . && useradd --system --uid 10001 tollbooth \
    && mkdir -p /var/lib/tollbooth && chown tollbooth /var/lib/tollbooth
USER tollbooth
EXPOSE 8080 9464
ENTRYPOINT ["tollbooth"]
CMD ["serve", "--listen", "0.0.0.0:8080", "--admin-listen", "0.0.0.0:9464"]
