"""The driver and coordinator side: the controller, one Ray Train worker group per part,
resources and placement, checks run before workers start, the backend, Ray internals."""
