# engineer C's one GPU run (issue 13's small training step): not committed
T0=$(date +%s)
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 75 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_short_backward.py tests/test_launch.py -k "not hopper" 2>&1 | tail -8 | tee $OUT/gpu_tests.txt
echo "tests done at $(( $(date +%s) - T0 )) s"
timeout 115 python3 benchmarks/bench_call_path.py --seqlens 128,512,1024,4096 --repeat 5 --providers flashgen,sdpa_flash,sdpa_flash_ctx --no-compile-check --diagnose --tag=-v6 --out $OUT 2>&1 | grep -v "^{" | tail -50
echo "bench done at $(( $(date +%s) - T0 )) s"
LEFT=$(( 222 - ($(date +%s) - T0) ))
echo "left for transformers: $LEFT s"
if [ $LEFT -gt 45 ]; then timeout $LEFT python3 benchmarks/bench_transformers.py --skip prefill generate compile_train_step --tag=-v6 --out $OUT 2>&1 | tail -10; fi
ls $OUT
