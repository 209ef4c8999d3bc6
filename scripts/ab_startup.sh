# Two trees on one machine, each through benchmarks/scripts/startup.py (cold: empty compile caches of its own; warm: the same
# caches again) on bench-dsv32: to the first token, phase by phase. The before tree travels as AB_TARBALL
# (`git archive $BEFORE minidsa setup.py | xz`), named BEFORE_COMMIT; run through `RUN_CMD=... gpu_check.sh run`.
before=/tmp/minidsa_before; here=$(pwd)
rm -rf $before && mkdir -p $before && tar -xJf "$AB_TARBALL" -C $before || exit 1
for side in before after; do
  tree=$here; commit=$MINIDSA_COMMIT
  [ $side = before ] && tree=$before && commit=$BEFORE_COMMIT
  (cd $tree && MINIDSA_COMMIT=$commit PYTHONPATH=$tree:$PYTHONPATH python3 $here/benchmarks/scripts/startup.py \
     --models bench-dsv32 --runs cold warm --timeout 200 --out $OUT/$side > $OUT/startup_$side.txt 2>&1)
  echo "$side ($commit) rc=$?"; grep -E "^\| " $OUT/startup_$side.txt || tail -5 $OUT/startup_$side.txt
done
