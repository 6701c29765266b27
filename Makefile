# The two quick-start commands (see README.md):
#   make demo   run the operator against a local control plane with example GPU nodes
#   make test   run the whole test suite
.PHONY: demo test crd

demo:
	cargo run --quiet -- render -f examples/

test:
	cargo test --locked

crd: generate

# Regenerate crds/ and the README's CRD reference from the Rust types.
generate:
	cargo run --quiet -- crd > crds/gpusharingpolicies.gpusharing.io.yaml
	cargo run --quiet -- crd --markdown > target/crd-reference.md
	python3 -c 'import re,sys; r=open("README.md").read(); t=open("target/crd-reference.md").read(); s="<!-- crd-reference:start -->\n"; e="<!-- crd-reference:end -->"; a=r.index(s)+len(s); b=r.index(e); open("README.md","w").write(r[:a]+t+r[b:])'
