# Two trees on one machine, each from empty compile caches of its own (MINIDSA_CACHE_DIR; DeepGEMM's JIT cache
# lives in it): cold start-up phase by phase, then the minidsa bench default workload. The before tree travels as
# AB_TARBALL (`git archive $BEFORE minidsa setup.py | xz`), named BEFORE_COMMIT; results go to $OUT/ab_cold.tgz.
before=/tmp/minidsa_before; here=$(pwd)
rm -rf $before && mkdir -p $before $OUT/ab_cold && tar -xJf "$AB_TARBALL" -C $before || exit 1
for side in before after; do
  tree=$here; commit=$MINIDSA_COMMIT
  [ $side = before ] && tree=$before && commit=$BEFORE_COMMIT
  rm -rf /tmp/mc_$side
  s=$(date +%s)
  (cd $tree && MINIDSA_COMMIT=$commit PYTHONPATH=$tree:$PYTHONPATH MINIDSA_CACHE_DIR=/tmp/mc_$side timeout 280 \
     python3 -m minidsa.cli bench --model bench-dsv32 --json $OUT/ab_cold/bench_$side.json --no-progress \
     > $OUT/ab_cold/bench_$side.log 2>&1)
  echo "$side ($commit) rc=$? wall=$(( $(date +%s) - s )) s"
  grep -E "start-up|output tok|ITL|TTFT" $OUT/ab_cold/bench_$side.log | tail -16
done
tar czf $OUT/ab_cold.tgz -C $OUT ab_cold && rm -rf $OUT/ab_cold
