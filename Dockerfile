# megatron_jetrl on NVIDIA's NGC PyTorch image: CUDA, cuDNN, NCCL, TransformerEngine and apex come
# built against the image's torch, which is what Megatron-core's TE layer spec needs.
#
# Pins, and why:
# - NGC_TAG: an NGC release whose torch is SGLang's pin (sglang 0.5.23 requires torch 2.14.1).
#   Every pip install below is constrained to the torch/TE/apex/triton already in the image, so a
#   tag with another torch fails this build at the check below instead of pip silently replacing
#   NGC's torch (and breaking TE's and apex's compiled extensions).
# - MEGATRON_CORE 0.19.2: the version the CPU CI and the H200 runs test (installed without deps:
#   its dependencies are already in the image).
# - SGLANG 0.5.23 / SGLANG_ROUTER 0.3.2: the versions whose ServerArgs, request classes and routes
#   the client is checked against (tests/test_fleet.py); sglang pulls its CUDA kernels (sgl-kernel,
#   flashinfer) pinned by its own metadata.
# Build:  docker build -t megatron-jetrl .      Run:  docker run --gpus all --ipc=host megatron-jetrl train --help
ARG NGC_TAG=26.04-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

ARG MEGATRON_CORE=0.19.2
ARG SGLANG=0.5.23
ARG SGLANG_ROUTER=0.3.2
ARG TORCH_EXPECTED=2.14

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_NVLS_ENABLE=0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Freeze what NGC built; refuse an image whose torch is not SGLang's.
RUN pip list --format=freeze | grep -iE '^(torch|transformer[-_]engine|apex|triton)==' > /opt/ngc-constraints.txt \
 && python -c "import sys, torch; v = torch.__version__; sys.exit(0 if v.startswith('${TORCH_EXPECTED}') else f'NGC torch {v} is not ${TORCH_EXPECTED}.x (sglang ${SGLANG}): choose another NGC_TAG')"

RUN pip install --no-cache-dir -c /opt/ngc-constraints.txt "sglang[all]==${SGLANG}" "sglang-router==${SGLANG_ROUTER}" \
 && pip install --no-cache-dir -c /opt/ngc-constraints.txt --no-deps "megatron-core==${MEGATRON_CORE}"

COPY . /opt/megatron_jetrl
RUN pip install --no-cache-dir -c /opt/ngc-constraints.txt "/opt/megatron_jetrl[hf,data]" \
 && python -c "import torch, megatron.core, sglang, transformer_engine, megatron_jetrl; print('image ok: torch', torch.__version__)"

# DeepGEMM's block-FP8 GEMM for the rollout decoder's 256-row linears (precision.decode_gemm=tune), built from the
# FlashInfer sglang installed, its 8B/70B kernels compiled now; new shapes compile into the same directory on first
# use (hence owned by the run user). A FlashInfer without those sources leaves the decoder on cuBLAS.
ENV JETRL_DEEPGEMM_DIR=/opt/jetrl-deepgemm
RUN FI="$(python -c 'import flashinfer, os; print(os.path.dirname(flashinfer.__file__))')" \
 && { python /opt/megatron_jetrl/tools/build_deepgemm_sm90.py --flashinfer "$FI" --out "$JETRL_DEEPGEMM_DIR" \
        --precompile-preset llama3.1-8b --precompile-preset llama3.1-70b \
      || echo "DeepGEMM not built from $FI: the rollout decoder keeps cuBLAS's GEMM"; }

# uid 1000 is NGC's ubuntu user on recent images; take a fixed one above it.
RUN useradd --create-home --shell /bin/bash --uid 10001 jetrl \
 && mkdir -p "$JETRL_DEEPGEMM_DIR" && chown -R 10001 "$JETRL_DEEPGEMM_DIR"
USER 10001
WORKDIR /home/jetrl

ENTRYPOINT ["jetrl"]
CMD ["--help"]
