"""The processes the tests start and talk to: engine-serve, the router, fake Kubernetes, Ray, gloo ranks."""
