.PHONY: demo test bench bench-quick

# The README's commands, for those who type make.
demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

bench:
	python -m bench

bench-quick:
	python -m bench --quick
