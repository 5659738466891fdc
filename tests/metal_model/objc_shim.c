// The Objective-C runtime calls that clang's code for csrc/mps_ops.mm makes on Linux, on top of gcc's
// libobjc (Debian's libobjc4) and the Blocks runtime (libBlocksRuntime). Test-side only: part of the
// model of Apple's platform that runs the native executor in CI (see README.md here).
//
// The code is compiled with -fobjc-runtime=gnustep-1.9 (the only non-Apple runtime with which clang
// accepts ARC) and legacy message dispatch (objc_msg_lookup_sender). gcc's libobjc runs the classes,
// selectors and message lookup; what it lacks is here:
// - ARC's entry points (objc_retain, objc_release, objc_storeStrong, the autorelease pool, ...),
//   sending retain/release/autorelease to objects and _Block_copy/_Block_release to blocks;
// - objc_msg_lookup_sender and objc_slot_lookup_super (the GNUstep ABI's lookups), on libobjc's
//   objc_msg_lookup and objc_msg_lookup_super;
// - __objc_exec_class: clang's GNUstep modules say ABI version 10 and a larger module header, whose
//   layout gcc's libobjc reads (version 8) is a prefix of; before libobjc's own __objc_exec_class
//   loads a module, the version and size are rewritten, protocols get gcc's version (2, for 3), the
//   "new ABI" class flag (gcc's "in construction") is cleared, and each class's non-fragile ivars are
//   placed after its superclass's, as GNUstep's runtime would (libobjc never moves ivars);
// - __gnustep_objcxx_personality_v0: C++ exceptions only (no Objective-C exception is ever thrown).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <objc/message.h>
#include <objc/runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unwind.h>

// -- blocks ------------------------------------------------------------------------------------------
extern void* _NSConcreteStackBlock[];
extern void* _NSConcreteMallocBlock[];
extern void* _NSConcreteGlobalBlock[];
void* _Block_copy(const void*);
void _Block_release(const void*);

static int is_block(id object) {
  void* isa = *(void**)object;
  return isa == (void*)_NSConcreteStackBlock || isa == (void*)_NSConcreteMallocBlock ||
         isa == (void*)_NSConcreteGlobalBlock;
}

static id send(id object, const char* name) {
  static SEL retain_sel, release_sel, autorelease_sel;
  SEL sel;
  if (name[2] == 't') {
    sel = retain_sel ? retain_sel : (retain_sel = sel_registerName("retain"));
  } else if (name[2] == 'l') {
    sel = release_sel ? release_sel : (release_sel = sel_registerName("release"));
  } else {
    sel = autorelease_sel ? autorelease_sel : (autorelease_sel = sel_registerName("autorelease"));
  }
  IMP imp = objc_msg_lookup(object, sel);
  return ((id(*)(id, SEL))imp)(object, sel);
}

id objc_retain(id object) {
  if (object == nil) return nil;
  if (is_block(object)) return (id)_Block_copy(object);
  return send(object, "retain");
}

void objc_release(id object) {
  if (object == nil) return;
  if (is_block(object)) {
    _Block_release(object);
    return;
  }
  send(object, "release");
}

id objc_autorelease(id object) {
  if (object == nil) return nil;
  if (is_block(object)) return object;  // (blocks are never autoreleased by the code here)
  return send(object, "autorelease");
}

id objc_retainBlock(id block) { return block == nil ? nil : (id)_Block_copy(block); }
id objc_retainAutorelease(id object) { return objc_autorelease(objc_retain(object)); }
id objc_retainAutoreleasedReturnValue(id object) { return objc_retain(object); }
id objc_autoreleaseReturnValue(id object) { return objc_autorelease(object); }
id objc_retainAutoreleaseReturnValue(id object) { return objc_autorelease(objc_retain(object)); }
id objc_unsafeClaimAutoreleasedReturnValue(id object) { return object; }

void objc_storeStrong(id* location, id value) {
  id old = *location;
  *location = objc_retain(value);
  objc_release(old);
}

// The autorelease pools: per thread, a stack of pending objects and the stack of open pools (the
// height of the objects when each was pushed). A push returns its depth as the marker; a pop releases
// what its pool holds. Popping a pool while a pool pushed after it is still open means that one was
// never popped (an exception unwound through its @autoreleasepool): recorded as a misuse.
#define POOL_LIMIT (1 << 20)
static __thread id* pool_items;
static __thread size_t pool_height, pool_capacity;
static __thread size_t* pool_marks;
static __thread size_t pool_depth, pool_marks_capacity;

void bnb_model_misuse_c(const char* what);  // (metal.mm)

void bnb_model_pool_add(id object) {
  if (pool_height == pool_capacity) {
    pool_capacity = pool_capacity ? pool_capacity * 2 : 256;
    if (pool_capacity > POOL_LIMIT) {
      fprintf(stderr, "metal model: autorelease pool overflow (%zu objects)\n", pool_height);
      abort();
    }
    pool_items = (id*)realloc(pool_items, pool_capacity * sizeof(id));
  }
  pool_items[pool_height++] = object;
}

void* objc_autoreleasePoolPush(void) {
  if (pool_depth == pool_marks_capacity) {
    pool_marks_capacity = pool_marks_capacity ? pool_marks_capacity * 2 : 16;
    pool_marks = (size_t*)realloc(pool_marks, pool_marks_capacity * sizeof(size_t));
  }
  pool_marks[pool_depth++] = pool_height;
  return (void*)pool_depth;
}

void objc_autoreleasePoolPop(void* marker) {
  size_t depth = (size_t)marker;
  if (depth == 0 || depth > pool_depth) {
    bnb_model_misuse_c("autorelease pool popped twice, or one never pushed");
    return;
  }
  if (depth != pool_depth) {
    bnb_model_misuse_c("autorelease pool popped while a pool pushed after it is still open (an exception "
                       "unwound through an @autoreleasepool?)");
  }
  size_t height = pool_marks[depth - 1];
  pool_depth = depth - 1;
  while (pool_height > height) {
    id object = pool_items[--pool_height];
    send(object, "release");
  }
}

size_t bnb_model_pool_height(void) { return pool_height; }
size_t bnb_model_pool_depth(void) { return pool_depth; }

void objc_enumerationMutation(id object) {
  fprintf(stderr, "metal model: a collection was mutated while being enumerated\n");
  abort();
}

// -- the GNUstep ABI on gcc's libobjc ------------------------------------------------------------------
struct objc_slot {
  Class owner;
  Class cachedFor;
  const char* types;
  int version;
  IMP method;
};
static __thread struct objc_slot lookup_slot;

struct objc_slot* objc_msg_lookup_sender(id* receiver, SEL selector, id sender) {
  lookup_slot.method = objc_msg_lookup(*receiver, selector);
  return &lookup_slot;
}

struct objc_slot* objc_slot_lookup_super(struct objc_super* super, SEL selector) {
  lookup_slot.method = objc_msg_lookup_super(super, selector);
  return &lookup_slot;
}

// The structures of a module as clang emits them for the GNUstep runtime (1.x, "legacy" ABI), whose
// leading fields are those of gcc's ABI 8 (objc-private/module-abi-8.h).
struct module_header {
  unsigned long version;
  unsigned long size;
  const char* name;
  struct symtab* symtab;
};
struct symtab {
  unsigned long sel_ref_cnt;
  void* refs;
  unsigned short cls_def_cnt;
  unsigned short cat_def_cnt;
  void* defs[1];  // classes, then categories
};
struct ivar {
  const char* name;
  const char* type;
  int offset;
};
struct ivar_list {
  int count;
  struct ivar ivars[1];
};
struct protocol {
  void* isa;  // the protocol ABI version until a runtime fixes it up: 3 from clang, 2 for gcc
  const char* name;
  struct protocol_list* protocols;
  void* instance_methods;
  void* class_methods;
};
struct protocol_list {
  struct protocol_list* next;
  size_t count;
  struct protocol* list[1];
};
struct legacy_class {
  struct legacy_class* isa;      // the metaclass
  const char* super_class;       // a name, until the runtime resolves it
  const char* name;
  long version;
  unsigned long info;
  long instance_size;            // non-fragile ABI: minus the size of the class's own ivars
  struct ivar_list* ivars;
  void* methods;
  void* dtable;
  void* subclass_list;
  void* sibling_class;
  struct protocol_list* protocols;
  void* gc_object_type;
  long abi_version;              // (GNUstep's fields from here on)
  int** ivar_offsets;            // -> each ivar's __objc_ivar_offset_value_... variable
};

struct category {
  const char* name;
  const char* class_name;
  void* instance_methods;
  void* class_methods;
  struct protocol_list* protocols;
};

#define NEW_ABI_FLAG 0x10  // GNUstep's "new ABI" class flag: gcc's _CLS_IN_CONSTRUCTION
#define GCC_PROTOCOL_VERSION 2

static void fix_protocols(struct protocol_list* list) {
  for (; list != NULL; list = list->next) {
    for (size_t i = 0; i < list->count; ++i) {
      struct protocol* p = list->list[i];
      if ((size_t)p->isa == 3) {
        p->isa = (void*)GCC_PROTOCOL_VERSION;
        fix_protocols(p->protocols);
      }
    }
  }
}

// Instance sizes of the classes laid out here so far (by name): a subclass's ivars start there.
static struct laid_out {
  const char* name;
  long size;
  struct laid_out* next;
}* laid_out_classes;

static long instance_size_of(const char* name) {
  for (struct laid_out* c = laid_out_classes; c != NULL; c = c->next) {
    if (strcmp(c->name, name) == 0) return c->size;
  }
  Class known = objc_lookup_class(name);
  if (known == Nil) {
    fprintf(stderr, "metal model: superclass %s is not loaded yet\n", name);
    abort();
  }
  return (long)class_getInstanceSize(known);
}

// What libobjc2 does for the non-fragile ABI and gcc's libobjc does not: put a class's ivars after its
// superclass's (the offsets clang emits are relative to that start) and set its instance size.
static void lay_out(struct legacy_class* cls, int non_fragile) {
  // (non-fragile: instance_size is minus the size of the class's own ivars, 0 without any)
  cls->info &= ~(unsigned long)NEW_ABI_FLAG;
  cls->isa->info &= ~(unsigned long)NEW_ABI_FLAG;
  fix_protocols(cls->protocols);
  fix_protocols(cls->isa->protocols);
  if (non_fragile && cls->instance_size <= 0) {
    long start = cls->super_class != NULL ? instance_size_of(cls->super_class) : 0;
    start = (start + 7) & ~7L;
    if (cls->ivars != NULL) {
      for (int i = 0; i < cls->ivars->count; ++i) {
        cls->ivars->ivars[i].offset += (int)start;
        if (cls->ivar_offsets != NULL && cls->ivar_offsets[i] != NULL) {
          *cls->ivar_offsets[i] = cls->ivars->ivars[i].offset;
        }
      }
    }
    cls->instance_size = start - cls->instance_size;
  }
  struct laid_out* entry = (struct laid_out*)malloc(sizeof *entry);
  entry->name = cls->name;
  entry->size = cls->instance_size;
  entry->next = laid_out_classes;
  laid_out_classes = entry;
}

void __objc_exec_class(struct module_header* module) {
  static void (*libobjc_exec_class)(struct module_header*);
  if (libobjc_exec_class == NULL) {
    libobjc_exec_class = (void (*)(struct module_header*))dlsym(RTLD_NEXT, "__objc_exec_class");
    if (libobjc_exec_class == NULL) {
      fprintf(stderr, "metal model: libobjc's __objc_exec_class not found\n");
      abort();
    }
  }
  if (module->version != 8) {
    struct symtab* symtab = module->symtab;
    for (unsigned i = 0; symtab != NULL && i < symtab->cls_def_cnt; ++i) {
      lay_out((struct legacy_class*)symtab->defs[i], module->version >= 9);
    }
    for (unsigned i = 0; symtab != NULL && i < symtab->cat_def_cnt; ++i) {
      // (clang puts every protocol the module names into a category, "AnotherHack", of a class that
      // never exists, __ObjC_Protocol_Holder_Ugly_Hack: libobjc keeps it unclaimed)
      fix_protocols(((struct category*)symtab->defs[symtab->cls_def_cnt + i])->protocols);
    }
    module->version = 8;
    module->size = sizeof(struct module_header);  // gcc's struct objc_module: version, size, name, symtab
  }
  libobjc_exec_class(module);
}

_Unwind_Reason_Code __gxx_personality_v0(int, _Unwind_Action, unsigned long long, struct _Unwind_Exception*,
                                         struct _Unwind_Context*);
_Unwind_Reason_Code __gnustep_objcxx_personality_v0(int version, _Unwind_Action actions, unsigned long long cls,
                                                    struct _Unwind_Exception* exception,
                                                    struct _Unwind_Context* context) {
  return __gxx_personality_v0(version, actions, cls, exception, context);
}
