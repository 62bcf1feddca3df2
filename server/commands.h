/* commands.h: the `caraserve` subcommands other than generate, one file each. */
#ifndef CS_COMMANDS_H
#define CS_COMMANDS_H

int cmd_batch(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_router(int argc, char **argv);

#endif
