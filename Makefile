# The two quick-start commands (see README.md):
#   make demo   run the operator against a local control plane with example GPU nodes
#   make test   run the whole test suite
.PHONY: demo test deny generate crd image

demo:
	bash tests/cluster/demo.sh

# Builds the local control plane, NVIDIA's parsers, the container image and the Go tools (Helm,
# actionlint) first (cached; a cold build of kube-apiserver takes several minutes), then every test.
test:
	bash tests/cluster/cluster.sh build
	bash tests/nvidia/build.sh
	bash tests/karpenter/build.sh
	bash tests/image/build.sh >/dev/null
	bash tests/tools/build.sh
	target/tools/cargo-deny check licenses bans sources
	# The benchmark is built only so that it keeps compiling; with the operator's `e2e` feature
	# (which gates the end-to-end tests, see Cargo.toml) it shares the operator's library
	# build with the test run below instead of compiling it a second time.
	cargo build --locked -p scale-bench --features gpu-sharing-operator/e2e
	cargo test --locked --features e2e
	cargo test --locked -p testkit --features gpu-sharing-operator/e2e
	bash tests/nvidia/build.sh test
	bash tests/cluster/cluster.sh test
	bash tests/karpenter/build.sh test
	bash tests/nvidia/conformance.sh

# The dependency graph against deny.toml: licenses, duplicate versions, wildcards, sources
# (advisories need the RustSec database from GitHub: the release workflow checks them).
deny:
	bash tests/tools/build.sh
	target/tools/cargo-deny check licenses bans sources

# Regenerate crds/ (and the chart's copy) and the CRD reference (docs/crd-reference.md) from the
# Rust types, the chart values table (docs/install.md) from charts/gpu-sharing-operator/values.yaml,
# and the figures of docs/figures.md counted from the tree.
generate:
	mkdir -p target
	cargo run --quiet -- crd > crds/gpusharingpolicies.gpusharing.io.yaml
	cp crds/gpusharingpolicies.gpusharing.io.yaml charts/gpu-sharing-operator/crds/
	cargo run --quiet -- crd --markdown > target/crd-reference.md
	python3 -c 'r=open("docs/crd-reference.md").read(); t=open("target/crd-reference.md").read(); s="<!-- crd-reference:start -->\n"; e="<!-- crd-reference:end -->"; a=r.index(s)+len(s); b=r.index(e); open("docs/crd-reference.md","w").write(r[:a]+t+r[b:])'
	GENERATE=1 cargo test --quiet --features e2e --test helm_chart docs_values_table_is_current
	GENERATE=1 cargo test --quiet --test docs counted_figures_are_current

crd: generate

# Scale benchmark (issues 6, 16): operator vs. minimal direct writes on the local control plane
# (up to 20,000 nodes x 200 policies), then a staged rollout of 5000 nodes at maxUnavailable 10% against waves x confirmation time.
# Then demand-driven MIG against every static layout on a seeded trace, in memory (issue 29).
# Results in target/bench/results.md, target/bench/rollout.md and target/bench/demand.md.
# Subset: make bench BENCH_ARGS="--configs 100x1,1000x20" ROLLOUT_ARGS="--rollout 1000".
BENCH_ARGS ?= --configs 100x1,100x20,100x100,1000x1,1000x20,1000x100,5000x1,5000x20,5000x100,20000x200
ROLLOUT_ARGS ?= --rollout 5000 --rollout-max-unavailable 10%
DEMAND_ARGS ?= --demand-trace 7
.PHONY: bench
bench:
	bash tests/cluster/cluster.sh build
	cargo build --release --locked -p gpu-sharing-operator -p scale-bench
	target/release/scale-bench $(BENCH_ARGS)
	target/release/scale-bench $(ROLLOUT_ARGS)
	target/release/scale-bench $(DEMAND_ARGS)

# Flood benchmark: the time from a node label change to the operator's write, quiet and under
# floods of pending pods (bogus MIG profiles, valid ones with a new selector key each, thousands
# of non-GPU pods), kube-scheduler running; results in target/bench/flood.md.
FLOOD_ARGS ?= --flood 3000
.PHONY: bench-flood
bench-flood:
	bash tests/cluster/cluster.sh build
	cargo build --release --locked -p gpu-sharing-operator -p scale-bench
	target/release/scale-bench $(FLOOD_ARGS)

# Live demand benchmark (issue 40): a small seeded MIG trace replayed in real time on the local
# control plane (kube-scheduler, the node simulator, the operator binary; a fresh control plane
# per configuration, ~5 minutes each) beside the model's replay of it; results in
# target/bench/demand-live.md. Not part of make test or CI (about 30 minutes).
DEMAND_LIVE_ARGS ?= --demand-live 7
.PHONY: bench-demand-live
bench-demand-live:
	bash tests/cluster/cluster.sh build
	bash tests/nvidia/build.sh
	cargo build --release --locked -p gpu-sharing-operator -p scale-bench
	target/release/scale-bench $(DEMAND_LIVE_ARGS)

# Fuzzing (issue 16, part 3): each cargo-fuzz target of fuzz/ for FUZZ_SECONDS, adding what it
# finds to fuzz/corpus/<target>/ (minimize with `cargo +nightly fuzz cmin <target>` before
# committing). Needs nightly Rust and cargo-fuzz (`cargo install cargo-fuzz`). make test
# replays the corpora and a seeded smoke run on stable (tests/fuzz_corpus.rs).
FUZZ_SECONDS ?= 600
FUZZ_TARGETS ?= policy_yaml render_mutated plan_labels
.PHONY: fuzz chaos
fuzz:
	@command -v cargo-fuzz >/dev/null || { echo "make fuzz: cargo install cargo-fuzz (and rustup toolchain install nightly)"; exit 1; }
	cd fuzz && for t in $(FUZZ_TARGETS); do \
		cargo +nightly fuzz run -O $$t corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) -max_len=16384 -print_final_stats=1 || exit 1; \
	done

# The chaos and hand-edit tests alone (they also run in make test).
chaos:
	bash tests/cluster/cluster.sh build
	bash tests/nvidia/build.sh
	CHAOS_FULL=1 cargo test --locked --features e2e --test e2e_chaos -- --nocapture

# The container image (Containerfile): with docker or podman when one can build, else the same
# image as an OCI layout in target/image/ without a container engine (tests/image/build.sh).
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
image:
	@if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then \
		docker build -f Containerfile --build-arg VERSION=$(VERSION) -t gpu-sharing-operator:$(VERSION) . ; \
	elif command -v podman >/dev/null 2>&1; then \
		podman build -f Containerfile --build-arg VERSION=$(VERSION) -t gpu-sharing-operator:$(VERSION) . ; \
	else \
		echo "make image: no container engine can build here: writing the OCI layout without one"; \
		VERSION=$(VERSION) bash tests/image/build.sh; \
	fi
