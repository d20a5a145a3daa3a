"""Integrations with other libraries' pipelines (optimum's ORT pipelines: ``accelerate``)."""
