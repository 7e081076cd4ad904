# The two commands a newcomer needs: `make report` (main job) and `make test`.
# Both create .venv when it is missing and install the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch when the venv has none: pip takes a CPU build from local disk where one lies there,
# PyPI's build elsewhere. A torch already in the venv is kept.
TORCH_PIN ?= torch==2.13.0

.PHONY: report test lab lint bench clean install bytecode

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# Every rank, launcher and kernel imports helpers: compiled once here, each process loads bytecode
# (0.6 s less per process, 2.0 s against 2.7 s with torch, where PYTHONDONTWRITEBYTECODE is set and
# nothing writes it otherwise; only changed files are compiled again).
bytecode: $(STAMP)
	$(PY) -m compileall -q helpers tests >/dev/null

report: bytecode
	$(PY) -m helpers report

# Two pytest workers, a test file each at a time (--dist loadfile: a module's fixtures, such as the
# catalog run once for all its cases, are not run again on the other worker; a notebook's cells
# share its kernel). Two at once keep CI's two cores about 90% busy, mostly with torch's import
# in each fresh rank and agent (2 s of CPU each with bytecode: tests share runs where that changes
# nothing tested): 14 to 15 min without Chromium, the notebooks 68 to 82 s; 17 to 18.5 min for all of
# make test from a fresh clone, install included (20 min is the bound). Each
# worker has its own temp folder, and the leftover checks look at their own worker's children,
# ports and temp folder alone.
test: bytecode
	$(PY) -m ruff check helpers tests bench
	$(PY) -m pytest tests -n 2 --dist loadfile
	$(PY) -m pytest --nbval-lax notebooks -p no:cacheprovider -n 2 --dist loadfile

# jupyter refuses to start as root (containers often are) without --allow-root
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

bench: $(STAMP)
	for f in bench/*.py; do $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) reports
