import sys

from xfw_jax import xla_env

xla_env.configure(sys.argv[1:])  # before JAX is imported: XLA reads its flags once

from xfw.contract import harness  # noqa: E402
from xfw_jax.explain import explain  # noqa: E402
from xfw_jax.session import build_session, describe  # noqa: E402
from xfw_jax.side_tasks import count_params, export_weights  # noqa: E402

sys.exit(harness.main(build_session, describe, export_weights=export_weights, count_params=count_params,
                      explain=explain))
