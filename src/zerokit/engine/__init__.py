"""The training engine and what it is assembled from."""
