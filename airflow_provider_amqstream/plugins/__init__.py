"""Airflow UI plugins of the provider (``streams.py``: the page of the streams)."""
