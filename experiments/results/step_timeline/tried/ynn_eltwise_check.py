import os,sys
os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"]="cpu"
sys.path[:0]=["experiments/cluster","experiments"]
import jax, numpy as np, time
import zeropp_jax as zpp
from cluster_worker import build
mesh=zpp.make_mesh(2)
name=sys.argv[1]
opts={'xla_cpu_experimental_ynn_fusion_type':sys.argv[2]} if len(sys.argv)>2 else {}
res=[]
for o in ({}, opts):
    state, step, batch, _ = build(name, 1536, 5, 64, mesh, 1)
    exe=step.lower(state,batch).compile(compiler_options=o)
    for i in range(2):
        state, m = exe(state, batch)
    jax.block_until_ready(state)
    t=time.perf_counter()
    for i in range(3): state,m=exe(state,batch)
    jax.block_until_ready(state); dt=(time.perf_counter()-t)/3
    res.append((jax.tree.leaves(state.params), float(m['loss'].addressable_data(0)), dt, exe.as_text().count('ynn_fusion')))
print('loss', res[0][1], res[1][1], 'time', res[0][2], res[1][2], 'ynn', res[0][3], res[1][3])
print('bitwise equal:', all(np.array_equal(np.asarray(a),np.asarray(b)) for a,b in zip(res[0][0],res[1][0])))
print('max diff:', max(float(np.max(np.abs(np.asarray(a,np.float32)-np.asarray(b,np.float32)))) for a,b in zip(res[0][0],res[1][0])))
