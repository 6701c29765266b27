# The two quick-start commands (see README.md):
#   make demo   run the operator against a local control plane with example GPU nodes
#   make test   run the whole test suite
.PHONY: demo test crd

demo:
	cargo run --quiet -- render -f examples/

test:
	cargo test --locked

crd:
	cargo run --quiet -- crd > crds/gpusharingpolicies.gpusharing.io.yaml
