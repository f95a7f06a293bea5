# The operator's image: `docker build -t kopf-reconcile:0.1.0 .`
# `make image` builds the same image without Docker (scripts/build_image.py: debootstrap,
# Debian's python3, the same venv, user and entrypoint, packed by umoci).

# --- build: the project's wheel and its dependencies, installed into a venv -----------------
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/kopf_reconcile ./operator/kopf_reconcile
RUN python -m pip wheel --no-cache-dir --no-deps -w /wheels . \
 && python -m venv /opt/kopf-reconcile \
 && /opt/kopf-reconcile/bin/pip install --no-cache-dir --disable-pip-version-check /wheels/*.whl \
 && find /opt/kopf-reconcile -name __pycache__ -prune -exec rm -rf {} +

# --- run: the venv, a non-root user with a passwd entry, the handlers file ------------------
FROM python:3.11-slim-bookworm
# kopf asks getpass.getuser() at startup: a uid without a passwd entry crashes it.
RUN groupadd --gid 10001 kopf \
 && useradd --uid 10001 --gid 10001 --home-dir /home/kopf --create-home \
      --shell /usr/sbin/nologin --comment kopf-reconcile kopf
COPY --from=build /opt/kopf-reconcile /opt/kopf-reconcile
COPY --chmod=0644 operator/examples/devices.py /app/handlers.py
ENV PATH=/opt/kopf-reconcile/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KOPF_RECONCILE_METRICS_HOST=0.0.0.0
WORKDIR /app
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["kopf-reconcile", "run"]
CMD ["/app/handlers.py"]
