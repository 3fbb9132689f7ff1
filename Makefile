# The two commands of the README: `make demo` and `make test`. Both install
# what is missing, configure and build first.
BUILD ?= build
MESON_FLAGS ?= -Dwerror=true
NINJA_JOBS ?=

.PHONY: all deps configure build test test-unit demo demo-gpt bench bench-gpt bench-diverge bench-moe bench-pull clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD)/build.ninja:
	meson setup $(BUILD) $(MESON_FLAGS)

configure: deps $(BUILD)/build.ninja

build: configure
	ninja -C $(BUILD) $(NINJA_JOBS)

test: build
	meson test -C $(BUILD) --print-errorlogs --num-processes 2

test-unit: build
	meson test -C $(BUILD) --print-errorlogs --suite unit

demo: build
	$(BUILD)/tools/cfmo-train --config conf/demo.toml $(if $(COMPARE),--compare)

demo-gpt: build
	$(BUILD)/tools/cfmo-train --config conf/gpt.toml
	$(BUILD)/tools/cfmo-train sample runs/gpt --prompt 'Q: ' --tokens 300 --top-k 40 --temperature 0.8

bench: build
	scripts/install-deps.sh --bench
	bench/train_vs_pytorch.sh

bench-gpt: build
	scripts/install-deps.sh --bench
	bench/gpt_vs_pytorch.sh

bench-diverge: build
	scripts/install-deps.sh --bench
	bench/diverge_vs_zstd.sh

bench-moe: build
	scripts/install-deps.sh --bench
	bench/moe_vs_mpi.sh
bench-pull: build
	scripts/install-deps.sh --bench
	bench/pull_vs_skopeo.sh

clean:
	rm -rf $(BUILD)
