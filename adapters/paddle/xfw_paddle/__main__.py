"""``python -m xfw_paddle``; also run as a script by ``paddle.distributed.launch``, hence the
absolute imports. A spec asking for the CPU test device (``backends.paddle.device: testcpu``) gets
its environment here, before Paddle is imported (Paddle loads custom devices once, at import)."""
import sys

from xfw_paddle.launch import prepare_testdevice

prepare_testdevice(sys.argv)

from xfw.contract import harness  # noqa: E402
from xfw_paddle.explain import explain  # noqa: E402
from xfw_paddle.session import build_session, describe  # noqa: E402
from xfw_paddle.side_tasks import count_params, export_weights, probe_modules  # noqa: E402

sys.exit(harness.main(build_session, describe, export_weights=export_weights, probe_modules=probe_modules,
                      count_params=count_params, explain=explain))
