import sys

from xfw.contract import harness
from xfw_torch.explain import explain
from xfw_torch.session import build_session, describe
from xfw_torch.side_tasks import count_flops, count_params, export_weights, probe_modules

sys.exit(harness.main(build_session, describe, export_weights=export_weights, probe_modules=probe_modules,
                      count_params=count_params, count_flops=count_flops, explain=explain))
