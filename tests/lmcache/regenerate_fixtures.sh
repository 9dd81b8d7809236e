#!/bin/sh
# Rewrite tests/data/lmcache: LMCache 0.5.6 itself writes every scenario of
# tests/lmcache/lmcache_writer.py in its small geometry (chunks of 16
# tokens, 2 layers, hidden 8, bf16) with its oracle.json, for hmem's tests
# to read without LMCache.  HMEM_LMCACHE_PYTHON names the interpreter of an
# environment with LMCache installed (.ci/run makes one).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python=${HMEM_LMCACHE_PYTHON:?HMEM_LMCACHE_PYTHON names no interpreter with LMCache 0.5.6}
exec "$python" "$here/lmcache_writer.py" small "$here/../data/lmcache"
