"""``python -m xfw_paddle``; also run as a script by ``paddle.distributed.launch``, hence the
absolute imports."""
import sys

from xfw.contract import harness
from xfw_paddle.session import build_session, describe
from xfw_paddle.side_tasks import count_params, export_weights, probe_modules

sys.exit(harness.main(build_session, describe, export_weights=export_weights, probe_modules=probe_modules,
                      count_params=count_params))
