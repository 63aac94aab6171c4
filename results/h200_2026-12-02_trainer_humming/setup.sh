# sourced at the start of every device call of session 5 (wheels once per machine)
[ -d /tmp/site/humming ] || pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HUMMING_CACHE_DIR=/tmp/humming/cache HUMMING_TMP_DIR=/tmp/humming/tmp
mkdir -p $HUMMING_CACHE_DIR $HUMMING_TMP_DIR
