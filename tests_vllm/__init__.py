"""tests_vllm is a package so that its conftest is imported as ``tests_vllm.conftest``: ``pytest tests tests_vllm``
then collects (the suite in tests/ imports its helpers with ``from conftest import ...``)."""
