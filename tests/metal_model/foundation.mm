// Model of the part of Foundation that csrc/mps_ops.mm and the Metal model use: NSObject with
// reference counting, NSString (UTF-8), NSArray (fast enumeration), NSURL (file paths) and NSError
// (a localized description), behaving as Apple documents them. Manual reference counting (this file
// is compiled without ARC; mps_ops.mm with it). Declared by tests/native_stubs/Foundation.
#import <Foundation/Foundation.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "model.h"

extern "C" {
id class_createInstance(Class cls, size_t extra);
id object_dispose(id object);
void bnb_model_pool_add(id object);
}

@interface NSObject () {
  std::atomic<long>* _references;
}
- (instancetype)retain;
- (void)release;
- (instancetype)autorelease;
- (void)dealloc;
@end

@implementation NSObject
+ (instancetype)alloc {
  NSObject* object = class_createInstance(self, 0);
  object->_references = new std::atomic<long>(1);
  bnb::model_count_object(+1);
  return object;
}
+ (instancetype) new {
  return [[self alloc] init];
}
+ (void)initialize {
}
- (instancetype)init {
  return self;
}
- (instancetype)retain {
  _references->fetch_add(1);
  return self;
}
- (void)release {
  if (_references->fetch_sub(1) == 1) {
    [self dealloc];
  }
}
- (instancetype)autorelease {
  bnb_model_pool_add(self);
  return self;
}
- (void)dealloc {
  delete _references;
  bnb::model_count_object(-1);
  object_dispose(self);
}
- (BOOL)respondsToSelector:(SEL)aSelector {
  return NO;
}
@end

@implementation NSString {
  std::string* _text;
}
+ (nullable instancetype)stringWithUTF8String:(const char*)text {
  NSString* out = [[self alloc] initWithBytes:text length:std::strlen(text) encoding:NSUTF8StringEncoding];
  return [out autorelease];
}
- (nullable instancetype)initWithBytes:(const void*)bytes length:(NSUInteger)length encoding:(NSStringEncoding)encoding {
  std::string text(static_cast<const char*>(bytes), length);
  if ((encoding != NSUTF8StringEncoding && encoding != NSASCIIStringEncoding) || !bnb::valid_utf8(text) ||
      (encoding == NSASCIIStringEncoding && !bnb::ascii(text))) {
    [self release];  // (Foundation: nil, the receiver released)
    return nil;
  }
  _text = new std::string(std::move(text));
  return self;
}
- (nullable const char*)UTF8String {
  return _text->c_str();
}
- (void)dealloc {
  delete _text;
  [super dealloc];
}
@end

NSString* bnb_model_string(const std::string& text) {
  return [[[NSString alloc] initWithBytes:text.data() length:text.size() encoding:NSUTF8StringEncoding] autorelease];
}

std::string bnb_model_text(NSString* string) {
  return string == nil ? std::string() : std::string([string UTF8String]);
}

@interface NSArray ()
- (void)modelAppend:(id)item;  // takes ownership of `item`
@end

@implementation NSArray {
  std::vector<id>* _items;
}
- (instancetype)init {
  _items = new std::vector<id>();
  return self;
}
- (void)modelAppend:(id)item {
  _items->push_back(item);
}
- (NSUInteger)count {
  return _items->size();
}
- (id)objectAtIndex:(NSUInteger)index {
  return _items->at(index);
}
- (NSUInteger)countByEnumeratingWithState:(NSFastEnumerationState*)state
                                  objects:(id __unsafe_unretained _Nullable[_Nonnull])buffer
                                    count:(NSUInteger)len {
  static unsigned long mutations = 0;  // (immutable)
  if (state->state >= _items->size()) {
    return 0;
  }
  state->itemsPtr = _items->data() + state->state;
  state->mutationsPtr = &mutations;
  NSUInteger n = _items->size() - state->state;
  state->state = _items->size();
  return n;
}
- (void)dealloc {
  for (id item : *_items) {
    [item release];
  }
  delete _items;
  [super dealloc];
}
@end

NSArray* bnb_model_array_of_strings(const std::vector<std::string>& texts) {
  NSArray* array = [[[NSArray alloc] init] autorelease];
  for (const std::string& text : texts) {
    [array modelAppend:[bnb_model_string(text) retain]];
  }
  return array;
}

@implementation NSDictionary
- (NSUInteger)count {
  return 0;
}
- (NSUInteger)countByEnumeratingWithState:(NSFastEnumerationState*)state
                                  objects:(id __unsafe_unretained _Nullable[_Nonnull])buffer
                                    count:(NSUInteger)len {
  return 0;
}
@end

@interface NSURL ()
- (const std::string&)modelPath;
@end

@implementation NSURL {
  std::string* _path;
}
+ (NSURL*)fileURLWithPath:(NSString*)path {
  NSURL* url = [[self alloc] init];
  url->_path = new std::string(bnb_model_text(path));
  return [url autorelease];
}
- (const std::string&)modelPath {
  return *_path;
}
- (void)dealloc {
  delete _path;
  [super dealloc];
}
@end

std::string bnb_model_url_path(NSURL* url) {
  return url == nil ? std::string() : [url modelPath];
}

@interface NSError ()
+ (NSError*)modelErrorWithDescription:(const std::string&)description code:(NSInteger)code;
@end

@implementation NSError {
  std::string* _description;
  NSInteger _code;
}
+ (NSError*)modelErrorWithDescription:(const std::string&)description code:(NSInteger)code {
  NSError* error = [[self alloc] init];
  error->_description = new std::string(description);
  error->_code = code;
  return [error autorelease];
}
- (NSErrorDomain)domain {
  return bnb_model_string("MTLLibraryErrorDomain");
}
- (NSInteger)code {
  return _code;
}
- (NSString*)localizedDescription {
  return bnb_model_string(*_description);
}
- (void)dealloc {
  delete _description;
  [super dealloc];
}
@end

NSError* bnb_model_error(const std::string& description, long code) {
  return [NSError modelErrorWithDescription:description code:code];
}
