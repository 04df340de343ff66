# The gateway and its embedded CPU engine in one image:
#   docker build -t tidegate:latest .
#   docker run --rm -p 8000:8000 tidegate:latest                  # embedded engine, no GPU
#   docker run --rm -p 8000:8000 -v $PWD/serve.yaml:/etc/tidegate/serve.yaml:ro \
#       tidegate:latest serve --config /etc/tidegate/serve.yaml   # in front of vLLM, SGLang, ...
# deploy/kubernetes/ runs it as the gateway Deployment.

FROM python:3.11-slim AS build
RUN python -m venv /opt/tidegate
ENV PATH=/opt/tidegate/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch's CPU build first, from its own index: an unpinned torch from PyPI is a CUDA build of several GB
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install '.[engine]'

FROM python:3.11-slim
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/tidegate tidegate
COPY --from=build /opt/tidegate /opt/tidegate
ENV PATH=/opt/tidegate/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/tidegate
USER 10001:10001
WORKDIR /home/tidegate
EXPOSE 8000 9100
ENTRYPOINT ["tidegate"]
CMD ["serve", "--host", "0.0.0.0"]
