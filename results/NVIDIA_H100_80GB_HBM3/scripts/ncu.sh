# ncu view of the d128 sm90 forward and backward main kernels (issues 11, 14)
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
$NCU --profile-from-start off --kernel-name regex:'sm90_(fwd|bwd)' --set full -f -o /tmp/ncu_d128 python3 ncu_view.py > $L/ncu_run.log 2>&1
$NCU --import /tmp/ncu_d128.ncu-rep --page details > $L/ncu_details.txt 2>&1
$NCU --import /tmp/ncu_d128.ncu-rep --page raw --csv > /tmp/ncu_raw.csv 2>&1
python3 - <<'PY' > $L/ncu_pipes.txt
import csv
rows = list(csv.reader(open("/tmp/ncu_raw.csv")))
hdr = rows[0]
want = [i for i, h in enumerate(hdr) if any(s in h for s in ("pipe_tensor", "Kernel Name", "gpu__time_duration.sum", "sm__throughput.avg.pct", "dram__throughput.avg.pct", "smsp__warp_issue_stalled", "sm__warps_active.avg.pct", "l1tex__data_bank_conflicts", "lts__t_sectors_op_red", "smsp__inst_executed.sum", "launch__registers"))]
for r in rows[2:]:
    print("----")
    for i in want:
        if i < len(r): print(hdr[i], "=", r[i])
PY
