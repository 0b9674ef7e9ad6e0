"""The --device option every command that runs a model takes (light: no torch import)."""


def add_device_argument(parser) -> None:
    parser.add_argument("--device", default="auto",
                        help="where to run: auto (the GPU when torch and this build can use one), cpu, cuda or cuda:N")
