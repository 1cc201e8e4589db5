"""The Ray placement (`placement.backend: ray`): the backend's parts as actors of a Ray cluster."""
