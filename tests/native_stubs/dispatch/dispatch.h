// Stand-in for <dispatch/dispatch.h> (Grand Central Dispatch): only what the native layer uses.
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);

#ifdef __cplusplus
extern "C" {
#endif
void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
#ifdef __cplusplus
}
#endif
