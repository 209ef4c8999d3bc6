# minidsa serve: start it, send one request, SIGTERM, time the exit and list what is left (processes, GPU memory).
# Usage: OUT=dir bash scripts/serve_exit.sh [serve flags] (default: --model tiny --distributed-executor-backend mp)
set -u

python3 -m minidsa.cli serve ${*:---model tiny --distributed-executor-backend mp} --port 8011 > "$OUT/serve_exit.txt" 2>&1 &
pid=$!
for i in $(seq 1 180); do
  curl -sf http://127.0.0.1:8011/health >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { echo "serve exited before it was ready:"; tail -5 "$OUT/serve_exit.txt"; exit 1; }
  sleep 1
done
curl -s http://127.0.0.1:8011/v1/completions -H 'Content-Type: application/json' -d '{"prompt":"hi","max_tokens":8}' | head -c 300; echo
curl -s http://127.0.0.1:8011/v1/completions -H "Content-Type: application/json" -d "{\"prompt\":\"hi\",\"max_tokens\":500,\"ignore_eos\":true}" > /dev/null &
sleep 1
t0=$(date +%s.%N); kill -TERM $pid; wait $pid; rc=$?; t1=$(date +%s.%N)
echo "serve ($*): exit code $rc, $(python3 -c "print(round($t1-$t0,2))") s after SIGTERM"
sleep 1; pgrep -fa "minidsa" | grep -v pgrep || echo "no minidsa process left"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | head
