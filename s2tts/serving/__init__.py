"""What a model process needs to serve under Triton, apart from the models: the request lifecycle, threads, pull
streams, Triton's inputs and responses, metrics, and the process's own life."""
